"""`python -m experiments.capacity` (an entry point; the code: experiments/studies/capacity.py)."""

from experiments.studies.capacity import main

if __name__ == "__main__":
    main()
