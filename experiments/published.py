"""`python -m experiments.published` (an entry point; the code: experiments/calibration/published.py)."""

from experiments.calibration.published import main

if __name__ == "__main__":
    main()
