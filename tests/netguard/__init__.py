"""The suite-wide network guard (see ``skylift_netguard``)."""
