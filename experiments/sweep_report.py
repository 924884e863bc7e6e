"""`python -m experiments.sweep_report` (an entry point; the code: experiments/studies/sweep_report.py)."""

from experiments.studies.sweep_report import main

if __name__ == "__main__":
    main()
