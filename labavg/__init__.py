"""labavg: data-parallel DNN acoustic-model training by periodic model averaging.

Importing the package has no side effects: no threads, no MPI initialisation, no
plotting extensions. Submodules are imported where they are used.
"""

__version__ = "0.1.0"
