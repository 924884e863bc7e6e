"""`python -m experiments.pipeline` (an entry point; the code: experiments/calibration/pipeline.py)."""

from experiments.calibration.pipeline import main

if __name__ == "__main__":
    main()
