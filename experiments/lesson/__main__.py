"""`python -m experiments.lesson [overrides]`: the command; the lesson is built in lesson.py."""
from experiments.compose import exit_on_bad_overrides
from experiments.lesson.lesson import main

exit_on_bad_overrides("lesson")
main()
