"""`python -m experiments.lesson [overrides]`: the command; the lesson is built in lesson.py."""
from experiments.lesson.lesson import main

main()
