"""The cleaning stage of data preparation: see train/clean/stage.py."""
