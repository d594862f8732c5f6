"""Started by Python at start-up in every process a test launches (this folder is on
``PYTHONPATH`` during the suite): the loopback-only network guard, before any user code."""

import skylift_netguard

skylift_netguard.install()
