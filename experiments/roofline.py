"""`python -m experiments.roofline model=... hardware=...`: the command; the arithmetic is in
experiments/hardware.py, the command's body in experiments/analysis/roofline_cli.py."""
from experiments.analysis.roofline_cli import main

if __name__ == "__main__":
    main()
