"""Reading Kaldi data, the built-in synthetic corpus, and the frame pipeline."""
