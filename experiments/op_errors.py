"""`python -m experiments.op_errors` (an entry point; the code: experiments/calibration/op_errors.py)."""

from experiments.calibration.op_errors import main

if __name__ == "__main__":
    main()
