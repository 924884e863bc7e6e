"""`python -m experiments.compare` (an entry point; the code: experiments/calibration/compare.py)."""

from experiments.calibration.compare import main

if __name__ == "__main__":
    main()
