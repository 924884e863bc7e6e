"""`python -m experiments.study` (an entry point; the code: experiments/studies/study.py)."""

from experiments.studies.study import main

if __name__ == "__main__":
    main()
