"""`python -m experiments.step_breakdown` (an entry point; the code: experiments/calibration/breakdown.py)."""

from experiments.calibration.breakdown import main

if __name__ == "__main__":
    main()
