"""Reference runs that pin behaviour across refactors (see ``scenarios.py``)."""
