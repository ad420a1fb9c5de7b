"""Training scripts. Each runs as `accelerate launch ... train/NAME.py` or `python -m train.NAME`."""
