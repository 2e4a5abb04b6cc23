/* reflux.h: the one header users include.
 *
 * reflux traces a C function into a tensor program, differentiates it in
 * reverse mode, compiles it for a device and runs it. A two-layer network's
 * forward pass:
 *
 *     static void forward(rf_trace *t, void *ctx) {
 *         struct net *n = ctx;                           // arrays on the device
 *         rf_tensor *x = rf_arg(t, 0);                   // [16, 4]
 *         rf_tensor *h = rf_tanh(rf_linear(x, rf_capture(t, n->w1), rf_capture(t, n->b1)));
 *         rf_return(t, rf_linear(h, rf_capture(t, n->w2), rf_capture(t, n->b2)));
 *     }
 *
 *     rf_exec *fwd;
 *     if (rf_compile(forward, &net, &x_dev, 1, &fwd) != RF_OK)
 *         fprintf(stderr, "%s\n", rf_errmsg());
 *     rf_array *y;
 *     rf_exec_run(fwd, &x_dev, 1, &y, 1);                // weights read by reference
 *
 * Sub-headers: core (status, dtypes, devices), array, trace (tracing,
 * compile, run, gradients), ops (the operations), nn (models, layers,
 * losses), optim (optimisers), train (withgradient, trainstep, train, the
 * compile cache), data (loaders, dataset readers, checkpoints).
 *
 * Threads: any call may be made from any thread (shared caches are locked,
 * error messages and statuses are per thread). Runs of one executable take
 * turns; a model, its optimiser state and a loader are used by one thread at
 * a time, which includes rf_setup and rf_opt_free on it and running
 * executables that capture it (a training step of a model another thread is
 * stepping, or of one of its layers, is refused: RF_E_INVALID).
 *
 * fork: a child process forked after reflux started threads runs on one
 * thread; executables compiled before the fork that call oneDNN refuse to run
 * there (RF_E_INVALID: compile them again in the child, rf_model_cache_clear
 * for cached steps), since oneDNN's primitives would wait for threads the
 * child does not have. Any thread may fork at any time, even while others
 * compile: the child compiles on its own, waiting for none of their work,
 * and keeps none of the module cache's locks (no process waits for it).
 * What another thread was using at the fork, though (an executable it was
 * running, an rf_jitted it was calling, a model it was stepping), may not be
 * used in the child: the child does not have that thread, and a call there
 * may wait for it for ever (or be refused).
 */
#ifndef REFLUX_H
#define REFLUX_H

#include "reflux/core.h"
#include "reflux/array.h"
#include "reflux/trace.h"
#include "reflux/ops.h"
#include "reflux/nn.h"
#include "reflux/optim.h"
#include "reflux/train.h"
#include "reflux/data.h"

#endif
