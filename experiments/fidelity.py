"""`python -m experiments.fidelity` (an entry point; the code: experiments/calibration/fidelity.py)."""

from experiments.calibration.fidelity import main

if __name__ == "__main__":
    main()
