"""Export: each kind's formats for the engines people deploy, their validator, and drafters made elsewhere."""
