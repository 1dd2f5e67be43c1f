"""Entry point of the code-interpreter service: ``python3 /opt/aenv-interpreter/serve.py``."""

from aenv_interpreter.server import main

main()
