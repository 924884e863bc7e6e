"""`python -m experiments.calibrate` (an entry point; the code: experiments/calibration/calibrate.py)."""

from experiments.calibration.calibrate import main

if __name__ == "__main__":
    main()
