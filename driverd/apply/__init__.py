"""Executing plans: steps run one at a time, each recorded in the journal before and after it runs,
so that a process killed at any point resumes (or keeps rolling back) on restart."""
