"""Infrastructure every layer may use: errors that say what a retry can fix (`errors`), atomic and
checked file writes (`fileio`), the working tree's run lock and its guardian (`lock`, `guardian`), and
derived seeds (`seeds`). Imports nothing else of arpo_core: the bottom of the library."""
