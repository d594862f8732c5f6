"""Measure a job here, predict its speed and bill on cloud instances, and rank them."""
