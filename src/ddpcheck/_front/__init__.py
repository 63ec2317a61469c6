"""The front doors' private parts: the command line's grammar and the live progress line a terminal
shows. The doors themselves (``api``, ``cli``, ``pytest_plugin``) sit at the package's top.
"""
