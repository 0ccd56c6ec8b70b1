"""The development toolkit: everything the tests, the chaos run, the benchmarks and
devstack share, and nothing an installed deployment needs.

Not installed by ``pip install .``: run from a checkout (the ops/ scripts and
pytest put the repository root on ``sys.path``). It may import the product;
the product never imports it.
"""
