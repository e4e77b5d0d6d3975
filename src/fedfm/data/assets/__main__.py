"""``python -m fedfm.data.assets``: fetch the assets that are not installed as packages.

A package's ``__main__`` rather than a ``__main__`` block in the module: ``fedfm.data``
imports the asset helpers when it loads, and running an already-imported module as the main
one makes Python warn (runpy's RuntimeWarning).
"""

from fedfm.data.assets import main

main()
