"""The ground floor: what every other floor may import -- the outcomes (``errors``), the checks of
what a user can pass (``options``), where ranks compute (``devices``) and how the script being run
is found again in other processes (``scripts``). No torch at import.
"""
