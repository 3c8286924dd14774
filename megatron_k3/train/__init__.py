"""Training: the typed job configuration (``config``), the ``Trainer`` with its one ``train_step`` (``trainer``),
the command line (``pretrain``), rank discovery (``launch_env``), metrics and plots."""
