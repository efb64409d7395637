"""Files, storage and the console: how the engine reads and writes anything outside the process.

- `files`: the one way a file or directory is written atomically, walks that skip temporaries, disk-full errors;
- `storage`: Google Cloud Storage, the one module that talks to it (retries, verified transfers);
- `lock`: one live run per output directory;
- `console`: a console that may go away while the run goes on, and the progress bar.

May import: utils.
"""
