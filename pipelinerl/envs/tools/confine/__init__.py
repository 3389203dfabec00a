"""The sandbox's launcher: scripts run by sandbox.py as `python -I launcher.py`, never imported (launcher.py)."""
