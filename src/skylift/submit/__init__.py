"""``skylift submit``: one job contract on five platforms.

``spec`` makes the platform-neutral :class:`~skylift.submit.spec.JobSpec` from the run
config and :class:`~skylift.config.submit.SubmitConfig`; one module per platform
(``sagemaker``, ``pai``, ``tione``, ``kubernetes``, ``skypilot``) builds its request
and talks to its API; ``environment`` is the other end, inside the job: it reads how
each platform tells a node its rank and master and turns that into torchrun's topology.
"""
