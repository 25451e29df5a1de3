"""The ``layerskip`` command line: one command per job, above the ``infer`` and ``train`` libraries (which never
import it). ``main.py`` builds the parser; ``args.py`` turns the settings dataclasses into flags; ``commands/``
holds one module per subcommand."""
