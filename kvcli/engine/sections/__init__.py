"""Documents longer than the window: cut into sections (cutting.py), prefilled as a sectioned cache (build.py),
ranked per question (select.py), composed into one prompt (compose.py) and answered with sources (session.py)."""
