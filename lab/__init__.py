"""The lab: one-off measurements and the scripts that run them (lab/README.md). The product
(src/draftling) never imports it."""
