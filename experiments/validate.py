"""`python -m experiments.validate RUN_DIR [--profile FILE]`: the command; the replay and the comparison
are in experiments/analysis/validate.py."""
import sys

from experiments.analysis.validate import main

if __name__ == "__main__":
    sys.exit(main())
