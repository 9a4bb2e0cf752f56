"""The course's tested package: every notebook imports its building blocks from here."""
