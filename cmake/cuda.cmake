# CUDA part of the extension: the FFI handlers plus one kernel instantiation per file
# (they compile in parallel, and JAXFLASH_HEAD_DIMS and JAXFLASH_DTYPES skip the ones not
# wanted).
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_ARCHITECTURES ${JAXFLASH_CUDA_ARCHS})

# A head dim d brings its forward kernels (fwd_hdim<d>_*, and fwd_hdim<d>x<Hv>_* for a
# narrower value head dim, e.g. the MLA 192x128), its sm90 forward and backward where there
# are, and
# its backward (bwd_hdim<d>_*, bwd_hdim<d>x<Hv>_*) where there is one; csrc/cuda/dispatch.h
# gets both lists.
set(_cuda_sources csrc/ffi_cuda.cu csrc/cuda/mask_tiles.cu)
if(NOT JAXFLASH_DTYPES)
  message(FATAL_ERROR "jaxflash: JAXFLASH_DTYPES is empty (fp16 and/or bf16)")
endif()
set(_with_fp16 0)
set(_with_bf16 0)
foreach(dt ${JAXFLASH_DTYPES})
  if(NOT dt MATCHES "^(fp16|bf16)$")
    message(FATAL_ERROR "jaxflash: JAXFLASH_DTYPES takes fp16 and/or bf16, got ${dt}")
  endif()
  set(_with_${dt} 1)
endforeach()
set(_inst_dir "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/instantiations")
set(JAXFLASH_BWD_HEAD_DIMS "")
set(_fwd_hdims "")
set(_bwd_hdims "")
foreach(hdim ${JAXFLASH_HEAD_DIMS})
  set(_fwd "")
  set(_sm90 "")
  set(_bwd "")
  foreach(dt ${JAXFLASH_DTYPES})  # instantiations/<kind>_hdim<d>[x<Hv>]_<dtype>.cu
    file(GLOB _f "${_inst_dir}/fwd_hdim${hdim}_${dt}.cu" "${_inst_dir}/fwd_hdim${hdim}x*_${dt}.cu")
    file(GLOB _s "${_inst_dir}/fwd_sm90_hdim${hdim}_${dt}.cu"
                 "${_inst_dir}/bwd_sm90_hdim${hdim}_${dt}.cu")
    file(GLOB _b "${_inst_dir}/bwd_hdim${hdim}_${dt}.cu" "${_inst_dir}/bwd_hdim${hdim}x*_${dt}.cu")
    list(APPEND _fwd ${_f})
    list(APPEND _sm90 ${_s})
    list(APPEND _bwd ${_b})
  endforeach()
  if(NOT _fwd)
    message(FATAL_ERROR "jaxflash: no CUDA kernels for head dim ${hdim}")
  endif()
  list(APPEND _cuda_sources ${_fwd} ${_sm90} ${_bwd})
  string(APPEND _fwd_hdims ",${hdim}")
  if(_bwd)
    list(APPEND JAXFLASH_BWD_HEAD_DIMS ${hdim})
    string(APPEND _bwd_hdims ",${hdim}")
  endif()
endforeach()

target_sources(_jaxflash_ext PRIVATE ${_cuda_sources})
# The build-info strings keep the lists' ";", which COMPILE_DEFINITIONS would split into
# separate definitions even when escaped (and nvcc splits -D values at ","), so module.cc and
# csrc/cuda/dispatch.h get them from a generated header.
file(CONFIGURE OUTPUT "${CMAKE_CURRENT_BINARY_DIR}/jaxflash_build_info.h" CONTENT
  "#define JAXFLASH_CUDA_ARCHS \"@JAXFLASH_CUDA_ARCHS@\"\n#define JAXFLASH_HEAD_DIMS \"@JAXFLASH_HEAD_DIMS@\"\n#define JAXFLASH_BWD_HEAD_DIMS \"@JAXFLASH_BWD_HEAD_DIMS@\"\n#define JAXFLASH_FWD_HDIMS @_fwd_hdims@\n#define JAXFLASH_BWD_HDIMS @_bwd_hdims@\n#define JAXFLASH_DTYPES \"@JAXFLASH_DTYPES@\"\n#define JAXFLASH_WITH_FP16 @_with_fp16@\n#define JAXFLASH_WITH_BF16 @_with_bf16@\n")
target_include_directories(_jaxflash_ext PRIVATE "${CMAKE_CURRENT_BINARY_DIR}")
set_source_files_properties(csrc/module.cc PROPERTIES
  COMPILE_OPTIONS "-include;${CMAKE_CURRENT_BINARY_DIR}/jaxflash_build_info.h")
target_compile_definitions(_jaxflash_ext PRIVATE JAXFLASH_WITH_CUDA)
# The sm90 kernels (wgmma, setmaxnreg) need the arch-specific sm_90a target.
if("90a" IN_LIST JAXFLASH_CUDA_ARCHS)
  target_compile_definitions(_jaxflash_ext PRIVATE JAXFLASH_SM90)
endif()
target_compile_options(_jaxflash_ext PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo --use_fast_math>)
target_link_libraries(_jaxflash_ext PRIVATE CUDA::cudart_static)
# The target exists before enable_language(CUDA), so it never saw CMAKE_CUDA_ARCHITECTURES.
set_target_properties(_jaxflash_ext PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
  CUDA_ARCHITECTURES "${JAXFLASH_CUDA_ARCHS}")
