"""Reference implementations of the exercise modules (the single source of the learner stubs in
labs/)."""
