"""DVC stages: one module per stage (``python -m stages.<name>``), each a thin run()/main()."""
