/* A torch dtype as csrc/dtype.h's element-type code, for the C++ ops. */
#ifndef KILN_ATEN_DTYPE_H
#define KILN_ATEN_DTYPE_H

#include <c10/core/ScalarType.h>

#include <cstdint>

/* 0 float32, 1 bfloat16; -1: no kernel reads this dtype. */
inline int32_t kiln_dtype_code(c10::ScalarType t) {
    return t == c10::kFloat ? 0 : t == c10::kBFloat16 ? 1 : -1;
}

#endif
