/* math.h, plus the vector expf of glibc's libmvec (x86-64: 8 at a time with AVX2) inside
 * `omp simd` loops. math.h declares it only under -ffast-math, which would also drop the
 * infinities a softmax relies on. */
#ifndef INFEROPS_VECTOR_MATH_H
#define INFEROPS_VECTOR_MATH_H
#include <math.h>
#if defined(__x86_64__)
#pragma omp declare simd notinbranch
float expf(float);
#endif
#endif
