"""PersonaPlex Live: `python app.py --help` lists the flags. The code is in personaplex_demo/cli/app.py;
this file is the entry point that Hugging Face Spaces run."""

import sys

from personaplex_demo.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
