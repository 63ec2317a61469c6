"""Inside a rank process: everything here runs in the processes a world spawns.

``serve`` joins the process group and answers the parent's tasks; ``runner`` trains one example
under a target and records it; ``recorder`` logs every ``torch.distributed`` collective the rank
issues (to the sequence file the parent watches); ``fitness`` checks the process is still fit for
the next task; ``orders`` permutes registration orders; ``transport`` packs records for the trip
to the parent (which unpacks them); ``freshness`` reports the user files a rank imported.
May import the scenario language, ``training`` and ``records``; never the world or the oracle.
"""
