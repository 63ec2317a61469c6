"""The sharding-rule checker (``ddpcheck fuzz-rule``), in one place.

``params`` holds the parameter lists a rule is called with (fixed ones and a Hypothesis
strategy); ``calls`` calls the rule inside rank processes, each call under a deadline; ``check``
drives the search from the parent and reports violations. Imports the world to run the calls.
"""
