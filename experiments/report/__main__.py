"""`python -m experiments.report DIR [--out DIR]`: the command; the report is built in report.py."""
import sys

from experiments.report.report import main

sys.exit(main())
