"""The operator console: the ledger in a browser (``ledgerctl console``), in a process of its own.

``app.create_app`` builds the Flask app; ``auth`` says who is asking and what they may do;
``replays`` runs confirmed bulk replays; ``charts`` draws the overview's chart as SVG.
"""
