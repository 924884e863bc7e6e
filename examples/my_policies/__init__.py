"""A user's own policies, kept outside the twinserve packages. Put ``examples/`` on PYTHONPATH to use them."""
