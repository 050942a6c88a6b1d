"""SplitFed (SFLv1) baseline: per-batch activations up, gradients down; W_c and W_e+W_g averaged every round."""
