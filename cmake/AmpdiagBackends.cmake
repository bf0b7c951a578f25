# Chooses the optional backends at configure time. Each option is AUTO (use it when it
# is found), ON (it is an error if it is missing) or OFF: never a silent half-build.

set(AMPDIAG_WITH_CUDA AUTO CACHE STRING "Build the CUDA kernels: AUTO, ON or OFF")
set(AMPDIAG_WITH_TORCH AUTO CACHE STRING "Build what links LibTorch (torch tests, benchmarks): AUTO, ON or OFF")
set_property(CACHE AMPDIAG_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set_property(CACHE AMPDIAG_WITH_TORCH PROPERTY STRINGS AUTO ON OFF)

function(ampdiag_check_choice name)
  if(NOT ${name} MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${name} must be AUTO, ON or OFF, not '${${name}}'")
  endif()
endfunction()
ampdiag_check_choice(AMPDIAG_WITH_CUDA)
ampdiag_check_choice(AMPDIAG_WITH_TORCH)

# --- CUDA -------------------------------------------------------------------------
set(AMPDIAG_HAVE_CUDA OFF)
if(NOT AMPDIAG_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # "native" fails on machines without a GPU: name the architectures.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    # The CUDA runtime is linked statically (CUDA::cudart_static below): the Python
    # extension and the agent then need only the driver at run time, and a CPU-only
    # machine imports them without libcudart.so.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(AMPDIAG_HAVE_CUDA ON)
  elseif(AMPDIAG_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "AMPDIAG_WITH_CUDA=ON but no CUDA compiler was found; "
                        "install the CUDA toolkit or set -DAMPDIAG_WITH_CUDA=OFF")
  else()
    message(STATUS "ampdiag: no CUDA compiler found, building the CPU kernels only")
  endif()
endif()

# --- LibTorch ---------------------------------------------------------------------
set(AMPDIAG_HAVE_TORCH OFF)
if(NOT AMPDIAG_WITH_TORCH STREQUAL "OFF")
  # TorchConfig appends its own -gencode list (including architectures CUDA 13 dropped)
  # to CMAKE_CUDA_FLAGS; our CUDA code takes CMAKE_CUDA_ARCHITECTURES only.
  set(ampdiag_cuda_flags_before_torch "${CMAKE_CUDA_FLAGS}")
  if(AMPDIAG_WITH_TORCH STREQUAL "ON")
    find_package(Torch REQUIRED)
  else()
    find_package(Torch QUIET)
  endif()
  set(CMAKE_CUDA_FLAGS "${ampdiag_cuda_flags_before_torch}")
  if(Torch_FOUND)
    set(AMPDIAG_HAVE_TORCH ON)
    # ampdiag_torch: LibTorch's libraries by their paths (TorchConfig's TORCH_LIBRARIES also
    # drags in the CUDA toolkit's own libraries, which need not match the wheel's).
    find_library(AMPDIAG_TORCH_CPU_LIB torch_cpu PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)
    find_library(AMPDIAG_C10_LIB c10 PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)
    set(AMPDIAG_TORCH_LIBS ${AMPDIAG_TORCH_CPU_LIB} ${AMPDIAG_C10_LIB})
    add_library(ampdiag_torch INTERFACE)
    target_include_directories(ampdiag_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
    target_compile_options(ampdiag_torch INTERFACE ${TORCH_CXX_FLAGS})
    # ATen's headers require C++20; only what includes them is built as C++20.
    target_compile_features(ampdiag_torch INTERFACE cxx_std_20)
    # A CUDA build links LibTorch's CUDA libraries too, so that the agent, the samples and the
    # tests run on CUDA tensors. Nothing names a symbol of libtorch_cuda: ATen's CUDA kernels
    # register when it loads, so it is linked with --no-as-needed (as TorchConfig does). Its
    # own dependencies (cuDNN, NCCL, ...) resolve through its RPATH into the wheel's nvidia/.
    set(AMPDIAG_HAVE_TORCH_CUDA OFF)
    if(AMPDIAG_HAVE_CUDA)
      find_library(AMPDIAG_TORCH_CUDA_LIB torch_cuda PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
      find_library(AMPDIAG_C10_CUDA_LIB c10_cuda PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
      if(AMPDIAG_TORCH_CUDA_LIB AND AMPDIAG_C10_CUDA_LIB)
        set(AMPDIAG_HAVE_TORCH_CUDA ON)
        list(APPEND AMPDIAG_TORCH_LIBS ${AMPDIAG_TORCH_CUDA_LIB} ${AMPDIAG_C10_CUDA_LIB})
        target_link_libraries(ampdiag_torch INTERFACE -Wl,--no-as-needed ${AMPDIAG_TORCH_CUDA_LIB} -Wl,--as-needed
                                                      ${AMPDIAG_C10_CUDA_LIB})
        # c10's CUDA headers include the toolkit's (cuda_runtime.h), which need not be on the
        # compiler's default path. Its include directories only: CUDA::toolkit would also add
        # the toolkit's library directory, whose NCCL then shadows the wheel's.
        target_include_directories(ampdiag_torch SYSTEM INTERFACE ${CUDAToolkit_INCLUDE_DIRS})
      else()
        message(STATUS "ampdiag: this LibTorch has no CUDA libraries; the agent and samples run on the CPU only")
      endif()
    endif()
    target_link_libraries(ampdiag_torch INTERFACE ${AMPDIAG_TORCH_CPU_LIB} ${AMPDIAG_C10_LIB})
    set_target_properties(ampdiag_torch PROPERTIES INTERFACE_LINK_OPTIONS "LINKER:-rpath,${TORCH_INSTALL_PREFIX}/lib")
  else()
    message(STATUS "ampdiag: LibTorch not found (set CMAKE_PREFIX_PATH to torch.utils.cmake_prefix_path); "
                   "building without the torch tests and benchmarks")
  endif()
endif()

# --- Python package (pybind11) -----------------------------------------------------
set(AMPDIAG_WITH_PYTHON AUTO CACHE STRING "Build the Python extension and package: AUTO, ON or OFF")
set_property(CACHE AMPDIAG_WITH_PYTHON PROPERTY STRINGS AUTO ON OFF)
ampdiag_check_choice(AMPDIAG_WITH_PYTHON)
set(AMPDIAG_HAVE_PYTHON OFF)
if(NOT AMPDIAG_WITH_PYTHON STREQUAL "OFF")
  find_package(Python COMPONENTS Interpreter Development.Module)
  if(Python_FOUND AND NOT pybind11_DIR)
    execute_process(COMMAND ${Python_EXECUTABLE} -m pybind11 --cmakedir OUTPUT_VARIABLE pybind11_dir
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(pybind11_dir)
      set(pybind11_DIR ${pybind11_dir} CACHE PATH "pybind11's CMake package" FORCE)
    endif()
  endif()
  if(Python_FOUND)
    find_package(pybind11 CONFIG QUIET)
  endif()
  if(pybind11_FOUND)
    set(AMPDIAG_HAVE_PYTHON ON)
  elseif(AMPDIAG_WITH_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "AMPDIAG_WITH_PYTHON=ON but Python development files or pybind11 were not found; "
                        "run scripts/bootstrap or pip install pybind11")
  else()
    message(STATUS "ampdiag: pybind11 not found, building without the Python package")
  endif()
endif()
