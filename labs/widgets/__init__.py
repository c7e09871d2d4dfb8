"""Interactive widgets (ipywidgets + matplotlib) over labs.theory and over measurements; logic
lives in labs.theory."""
