"""`python -m experiments.plan [overrides] cluster.gpus=N`: the command; the search is in
experiments/analysis/plan.py."""
from experiments.analysis.plan import main

if __name__ == "__main__":
    main()
