"""`python -m experiments.profile [overrides]`: the command; the profile is measured and fitted in
experiments/analysis/profile.py (its calibration in experiments/analysis/calibrate.py)."""
from experiments.analysis.profile import main

if __name__ == "__main__":
    main()
