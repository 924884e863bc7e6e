"""`python -m experiments.quant_study` (an entry point; the code: experiments/studies/quant_study.py)."""

from experiments.studies.quant_study import main

if __name__ == "__main__":
    main()
