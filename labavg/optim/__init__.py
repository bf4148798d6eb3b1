"""Optimizers: plain SGD and Kaldi's natural-gradient SGD, both with Kaldi's max-change."""
